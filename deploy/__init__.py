"""Ray deployment: the YAML config, the hosts of worker and gateway processes (actors), the
controller (membership, health, healing, scaling, and the online planner's loop that asks it
to scale) and the `pdserve` command. What the deployment's sizes should be is the planner's
question (deploy/planner/): this runtime imports it, never the other way."""
