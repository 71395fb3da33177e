"""symmerge's options, declared once: :mod:`.schema` (the :class:`~.schema.Option` record), :mod:`.declared`
(every option of the commands), :mod:`.parse` (how the less plain values are read), :mod:`.build` (the options
objects the parsed values make), :mod:`.paths` (the options that name files and folders, and their ``~``).
``symmerge/commands/schema_args.py`` generates the argparse flags from them, :mod:`symmerge.config.schema` the
config keys. No argparse here."""
