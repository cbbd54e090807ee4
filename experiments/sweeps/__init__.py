"""Sweeps of a config: planned (plan.py), launched (launch.py) and reported (report.py)."""
