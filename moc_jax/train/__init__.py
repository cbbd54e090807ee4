"""Training: optimizer and schedules, the jitted step, the loop."""
