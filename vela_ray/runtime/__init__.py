"""The run itself, with no Ray in it: `runner.JobRunner` drives profile -> place -> train ->
checkpoint -> export -> summary -> report over a `pool.WorkerPool` (where the experts live).

`local.InProcessPool` hosts the ExpertManagers in this process (tests, one-process runs);
`actors.pool.RayWorkerPool` hosts them as Ray actors, and `actors.master.MasterActor` is the
thin actor that runs a JobRunner over it.
"""
