"""Old home of `FreezeBackbone`, which lives in training/callbacks/ with every other callback; kept so that a config
naming `training.freezing.FreezeBackbone` still runs."""


def __getattr__(name: str):
    from training.faults import moved_callback

    return moved_callback(__name__, name, ("FreezeBackbone",))
