"""Ray deployment: pools as placement groups, the controller, the planner, the CLI.

Not built yet; see DESIGN.md (Deployment).
"""
