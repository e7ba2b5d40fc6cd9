"""The cluster model: what a run costs in GPU hours and bytes moved (cluster_cost), and
whether each task's timeout covers its work, retries included (run_budget)."""
