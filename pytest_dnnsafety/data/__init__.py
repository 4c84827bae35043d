"""Input forms, tasks and argument checks: what the plugin accepts as data, and how it is checked (above the core; imports only it)."""
