"""The 931-task tree and a 50-level chain on orgchart, LangGraph and DBOS, side by side.

    python -m bench.peers [--json] [--leads 30] [--writers 30] [--delay 1.0] [--depth 50]

Each runtime's tree is a small module written by its own documentation's patterns
(:mod:`bench.peers.orgchart_tree`, :mod:`bench.peers.langgraph_tree`,
:mod:`bench.peers.dbos_tree`); :mod:`bench.peers.shape` holds what they share (the prompts,
the model clients); :mod:`bench.peers.harness` runs each in its own process against the
same loopback model server and PostgreSQL server, measures it, SIGKILLs it half way and
resumes it.
"""
