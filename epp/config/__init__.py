"""The EPP's configuration: the EndpointPickerConfig document (`loader`: parsed once, each section handed to its
owner) and the typed reading of a section's parameters (`parameters`)."""


class ConfigError(ValueError):
    """An invalid configuration: reported at startup, never on the request path."""
