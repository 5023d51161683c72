"""The engine: the worker loop, the executor that runs agents, the judge stage, maintenance."""
