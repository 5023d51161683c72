"""The fleet: the orchestrator fire, its decider, the rollup note, and the doctor."""
