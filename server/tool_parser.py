"""The tool-call parsers under this module's name, which other modules and tests import: everything lives in
server/tool_parsers/, one module per format."""

from flotilla.server.tool_parsers import *  # noqa: F403
from flotilla.server.tool_parsers import __all__  # noqa: F401
