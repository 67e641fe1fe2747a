"""`ngrammys serve`: the OpenAI-compatible HTTP API, its flags one per setting."""

from __future__ import annotations

import argparse
import logging
import sys

from app.settings import Settings


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; a boolean one is a switch, `--x` / `--no-x`. Unset flags stay None,
    so the `NGRAMMYS_*` variables and the defaults decide them."""
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        shown_default = "" if info.default is None else f"; default: {info.default}"
        text = f"{info.description} [env NGRAMMYS_{name.upper()}{shown_default}]"
        if info.annotation is bool:
            parser.add_argument(
                flag, dest=name, default=None, action=argparse.BooleanOptionalAction, help=text
            )
        else:
            parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=text)


def serve_settings(args: argparse.Namespace) -> Settings:
    """The server's settings: the flags given, else the `NGRAMMYS_*` variables, else the
    defaults."""
    return Settings(
        **{
            name: getattr(args, name)
            for name in Settings.model_fields
            if getattr(args, name) is not None
        }
    )


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from app.main import create_app
    from app.shutdown import DrainingServer

    def stop() -> None:  # the model failed to load: this process can never serve
        server.should_exit = True

    try:
        settings = serve_settings(args)
        app = create_app(settings, on_load_failure=stop)
    except (ValueError, OSError) as error:  # bad settings, an unreadable key file
        sys.exit(f"ngrammys serve: {error}")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app, settings.drain_timeout)
    server.run()
    if app.state.load_error:
        sys.exit(f"ngrammys serve: the model failed to load: {app.state.load_error}")
    if not server.started:
        sys.exit(3)  # uvicorn could not start (e.g. the port is taken); it logged why
