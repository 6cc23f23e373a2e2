from cachebuild.cli import main

main()
