"""Hyperparameter sweeps on the job service: Ray Tune decides, every trial is a service job.

``spec`` (pure): the sweep spec, its validation and its translation into Tune's search space.
"""
