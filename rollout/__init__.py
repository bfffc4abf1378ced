from rollout import _moved

_moved.install()
