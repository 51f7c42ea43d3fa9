"""The one exception type for unusable scene data."""


class SceneError(ValueError):
    """A scene on disk cannot be used; the message names the file or folder and the problem.

    Raised by the loaders before any training starts, so a bad data set fails fast and clearly.
    """
