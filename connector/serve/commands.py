"""The console commands' entry points (``[project.scripts]``): each checks what it needs before
importing its server, so a missing extra is one line and exit code 2, not a traceback."""

from __future__ import annotations

from .cli import require_serve_extras

__all__ = ["demo", "demo_vllm", "node", "proxy", "replay", "store"]


def proxy() -> int:
    """``kvbridge-proxy``: ``kvbridge.connector.serve.proxy``."""
    require_serve_extras("kvbridge-proxy")
    from .proxy import main

    return main()


def store() -> int:
    """``kvbridge-store``: ``kvbridge.connector.serve.store_server``."""
    from .store_server import main

    return main()


def node() -> int:
    """``kvbridge-node``: ``kvbridge.connector.serve.node.server``."""
    require_serve_extras("kvbridge-node")
    from .node.server import main

    return main()


def demo() -> int:
    """``kvbridge-demo``: ``kvbridge.connector.serve.demo.pd_pair``."""
    require_serve_extras("kvbridge-demo")
    from .demo.pd_pair import main

    return main()


def demo_vllm() -> int:
    """``kvbridge-demo-vllm``: ``kvbridge.connector.serve.demo.vllm_pd``."""
    require_serve_extras("kvbridge-demo-vllm")
    from .demo.vllm_pd import main

    return main()


def replay() -> int:
    """``kvbridge-replay``: ``kvbridge.connector.serve.replay.trace``."""
    from .replay.trace import main

    main()
    return 0


COMMANDS = {"proxy": proxy, "store": store, "node": node, "demo": demo, "demo-vllm": demo_vllm,
            "replay": replay}


if __name__ == "__main__":  # python -m kvbridge.connector.serve.commands NAME [ARGS]: the Makefile
    import sys

    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: python -m kvbridge.connector.serve.commands {{{','.join(COMMANDS)}}} ...")
    name = sys.argv.pop(1)
    sys.argv[0] = f"kvbridge-{name}"
    sys.exit(COMMANDS[name]())
