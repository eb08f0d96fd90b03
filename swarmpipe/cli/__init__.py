"""The ``swarmpipe`` command: flags and config files into the config tree, then each role's entry point.

No protocol logic lives here: every subcommand hands its config to the role's own package.
"""
