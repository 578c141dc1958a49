from specdec.extras import require_serving

require_serving("python -m http_gateway")

from http_gateway.server import main  # noqa: E402 - after the check, which names what is missing

main()
