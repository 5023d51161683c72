"""orgchart package."""
