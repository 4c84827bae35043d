"""What every engine family builds on: the engine protocol and its states, the runner (the one batch loop), the model-output guard, activation capture, detector scores."""
