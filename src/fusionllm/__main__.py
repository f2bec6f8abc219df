from fusionllm.cli.main import main

main()
