"""The HTTP face: the FastAPI app, its auth, and the web page (``web/``)."""
