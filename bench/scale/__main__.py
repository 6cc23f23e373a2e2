from bench.scale.harness import main

raise SystemExit(main())
