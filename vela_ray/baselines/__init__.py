"""Baselines vela-ray is measured against: conventional expert parallelism (`expert_parallel`)."""
