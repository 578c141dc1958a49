from http_gateway.server import main

main()
