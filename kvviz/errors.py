"""The one exception kvviz raises for anything a user can fix: its message is a single clear line."""


class KvvizError(Exception):
    """A problem with the user's input or environment, with a one-line message meant for people."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
