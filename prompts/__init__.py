"""The built-in agents' prompts, one markdown file each (shipped with the package)."""
