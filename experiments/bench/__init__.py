"""Performance benchmarks (P1 train_mfu, P2 moc_vs_vanilla, P4 bank_scaling, P5 xla_vs_analytic) and
the peak FLOP/s that MFU divides by; results and commands in docs/performance.md."""
