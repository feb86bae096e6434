"""The user-error type of the whole product."""


class ConfigError(ValueError):
    """Something the user gave (a flag, a config key, a file, the job's shape)
    is wrong. The message is one line naming the culprit and the fix."""
