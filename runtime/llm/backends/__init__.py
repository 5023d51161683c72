"""The model backends, one module each, and the choice between them (``choice.py``).

``ollama.py`` (with its HTTP transport, ``transport.py``), ``offline.py`` and
``replay.py``; :func:`runtime.llm.backends.choice.build_backend` picks one.
"""
