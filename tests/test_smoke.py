def test_add(client, worker, spec):
    steps = [
        {"tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
        {"content": "5"},
    ]
    run = client.submit(spec(steps, tools=["add"]))
    result = run.wait(timeout=30)
    print(result.model_dump_json(indent=1))
    assert result.status == "completed"
    assert result.tool_calls[0].output == 5
