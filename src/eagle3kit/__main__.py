from eagle3kit.cli.app import main

main()
