"""The subcommands of ``quantree`` that stand in a module of their own (``compare`` and
``report``, ``export``) and where the command line gets a model (a saved program or the
user's factory). ``tools/cli.py`` runs them; ``quantree_cli`` defines their arguments."""
