"""The ``zeroshard`` command line tool.

One module per subcommand (``launch``, ...), registered in :data:`zeroshard.cli.main.COMMANDS`.
Importing this package is cheap: torch is only imported by the subcommands that need it.
"""
