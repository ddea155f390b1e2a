"""Benchmarks against the roofline: `moegen bench` and tools/gpu_check.py share these pieces.

roofline: the measured ceilings, a call's floor, the read-only bound and the timer;
peers: the implementations moegen is compared with; cells: one token count of one spec, every
implementation checked against the float64 reference then timed; report: tables and JSON.
"""
