"""Task handlers shipped with the server (math, code, swe, cli_agent, shout, choice, arithmetic).

Each one is a plugin like any user's: it imports the plugin API from :mod:`prorl_server.plugin` and is found
through the ``prorl_server.handlers`` entry points in ``setup.cfg``; the server never imports this package.
"""
