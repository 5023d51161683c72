"""The web view: plain HTML, CSS and JavaScript served by runtime.http.api."""
