"""The first code of a sandboxed program (``python -I -B -u -c <source of _run_user_program> <mode>``):
``tools/sandbox_run.py`` sends this function's source, so it imports nothing but the standard library
and defines everything it uses inside itself.
"""

from __future__ import annotations


def _run_user_program() -> None:
    """The program's first code (``python -I -B -u -c <this> <mode>``): refuse non-AF_UNIX sockets when
    there is no network namespace, then run main.py as ``__main__``; a traceback starts in main.py."""
    import builtins
    import sys
    import traceback

    import __main__

    if sys.argv[1:] == ["block-sockets"]:
        import _socket
        import socket

        def refuse() -> None:
            raise PermissionError(13, "network access is disabled in this sandbox")

        base_init = _socket.socket.__init__  # socket.socket calls _socket.socket.__init__ with its own self

        class GuardedSocket(_socket.socket):
            def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
                if fileno is None and family != _socket.AF_UNIX:
                    refuse()
                base_init(self, family, type, proto, fileno)

        socket_init = socket.socket.__init__

        def guarded_init(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family != socket.AF_UNIX:
                refuse()
            socket_init(self, family, type, proto, fileno)

        socket.socket.__init__ = guarded_init
        _socket.socket = _socket.SocketType = GuardedSocket
    sys.argv = ["main.py"]
    with open("main.py", "rb") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        sys.exit(1)
    namespace = __main__.__dict__
    namespace.clear()
    namespace.update(__name__="__main__", __file__="main.py", __builtins__=builtins, __doc__=None)
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)
