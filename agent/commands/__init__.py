"""The command layer: the `dra-agent` command line (`cli`), what each command does (`handlers`: `run`,
`discover`, `backends`), how results are shown (`output`), and the static checks of a backend that
`dra-agent backends --check` and the conformance kit share (`backend_rules`, `backend_check`).

Nothing in the daemon's parts imports this package; it imports them to wire a command together.
"""
