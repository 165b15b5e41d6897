"""Hyperparameter sweeps on the job service: Ray Tune decides, every trial is a service job.

``spec`` (pure): the sweep spec, its validation and its translation into Tune's search space.
``requests``: a sweep's submit, pause, resume and cancel, as the API and the CLI take them.
``runner``: the sweep's runner actor and the Tune driver it runs. ``proxy``: the trial proxy Tune
runs for each trial (it submits the trial's job and reports the job's evaluations).
``segments``: Tune's checkpoint as a pointer to the job's committed one; PBT's exploit as a new
segment. ``scheduler``: Tune's scheduler and callback. ``stops``: Tune's end of a trial as a
cancel or a held pause of its job. ``tracking``: the sweep's MLflow parent run, segment marks and
curves. ``outcome``: the trials' table and the best trial. ``reconcile``: the reconciler's pass
over the sweeps. ``names``: the runner's actor and Tune's experiment. ``process``: how a sweep's
processes start.
"""
