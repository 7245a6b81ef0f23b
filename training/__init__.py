"""The run layer: the imgcls command, callbacks, strategies and sweeps."""
