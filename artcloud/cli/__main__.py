from artcloud.cli import main

main()
