"""Calibration: the microbenchmark workers that measure a machine (GEMM, attention, collectives, memory,
the trainer itself), their results folder, the Slurm script, and the fit that writes a profile."""
