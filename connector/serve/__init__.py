"""The servers a kvbridge deployment runs, as console commands (``[project.scripts]``).

=======================  ===========================================================================
``kvbridge-proxy``       the P/D proxy in front of prefill and decode servers (vLLM or kvbridge's)
``kvbridge-store``       a store node: the remote tier cold blocks are written to and restored from
``kvbridge-node``        kvbridge's own reference engine as an OpenAI-style completions server
``kvbridge-demo``        the main job: a Redis index, P and D nodes, real text, checked token for
                         token against a single node (``make demo``)
``kvbridge-demo-vllm``   the same between two ``vllm serve`` processes (``make demo-vllm``)
``kvbridge-replay``      a Mooncake-format trace replayed against node caches (hit ratios)
=======================  ===========================================================================

Each follows ``cli``'s contract (``--help``, one-line errors with exit code 2, one JSON line once
serving, SIGTERM / Ctrl-C). The HTTP servers need the ``serve`` extra (``pip install
'kvbridge[serve]'``); ``kvbridge.connector`` never imports this package.
"""
