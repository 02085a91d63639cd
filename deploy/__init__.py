"""Ray deployment: the YAML config, the hosts of worker and gateway processes (actors), the
controller (membership, health, healing, scaling) and the `pdserve` command."""
