"""The tool-call parsers' import path of old: everything now lives in server/tool_parsers/, one module per format."""

from flotilla.server.tool_parsers import *  # noqa: F403
from flotilla.server.tool_parsers import __all__  # noqa: F401
