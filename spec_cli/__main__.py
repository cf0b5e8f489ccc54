from spec_cli.cli import main

main()
