"""`prfaas search`: which deployment serves the most requests per dollar with the SLO held.

space.py reads a search space and expands it into configurations (deployment, cost, the
planner's prediction); explorer.py measures each with the simulation's capacity search and
summarises (frontier, best per budget, equal-cost gain); pool.py runs the simulations as Ray
tasks or in this process; report.py writes the table and plots.
"""
