"""The pytest adapter: hooks, options and fixtures (hooks), fixture loaders (fixtures), the run's bookkeeping per process role (session), and the generated reference (reference). The top layer."""
