"""Reading back what a deployment's processes logged: `pdserve trace` joins one request's
events from every process's log into a timeline (trace.py), built on the log-folder readers
(logs.py) that the planner's step-log fit uses too. The lines themselves are written where
things happen (common/trace.py, worker/step_log.py), into the files deploy/process_log.py
rotates. Nothing here imports the Ray runtime or the planner."""
