// The official openai JavaScript/TypeScript SDK against a running Tollgate: reads OPENAI_BASE_URL,
// OPENAI_API_KEY and TOLLGATE_MODEL from the environment, calls the Responses API (plain, streamed,
// structured, a tool round trip, previous_response_id), embeddings (float and base64) and chat, and
// prints what it saw as one JSON object for tests/e2e/test_typescript_sdk.py to check.
import OpenAI from "openai";

const client = new OpenAI({ maxRetries: 0 });
const model = process.env.TOLLGATE_MODEL;
const out = {};

const plain = await client.responses.create({ model, input: "Say hello", max_output_tokens: 6, temperature: 0 });
out.plain = { id: plain.id, status: plain.status, text: plain.output_text, usage: plain.usage };

const stream = client.responses.stream({ model, input: "Say hello", max_output_tokens: 6, temperature: 0 });
const kinds = [];
let streamed = "";
for await (const event of stream) {
  kinds.push(event.type);
  if (event.type === "response.output_text.delta") streamed += event.delta;
}
out.stream = { kinds, text: streamed };

const schema = {
  type: "object", properties: { city: { type: "string", maxLength: 10 }, sunny: { type: "boolean" } },
  required: ["city", "sunny"], additionalProperties: false,
};
const structured = await client.responses.create({
  model, input: "Weather in Paris as JSON", max_output_tokens: 200, temperature: 0,
  text: { format: { type: "json_schema", name: "weather", schema, strict: true } },
});
out.structured = { status: structured.status, parsed: JSON.parse(structured.output_text) };

const tool = {
  type: "function", name: "get_weather", strict: true,
  parameters: { type: "object", properties: { city: { type: "string", maxLength: 8 } }, required: ["city"],
                additionalProperties: false },
};
const first = await client.responses.create({
  model, input: "Weather in Paris?", tools: [tool], tool_choice: { type: "function", name: "get_weather" },
  max_output_tokens: 100, temperature: 0,
});
const call = first.output[0];
const answer = await client.responses.create({
  model, tools: [tool], max_output_tokens: 4, previous_response_id: first.id,
  input: [{ type: "function_call_output", call_id: call.call_id, output: JSON.stringify({ temp: 21 }) }],
});
out.tools = { call: { type: call.type, name: call.name, arguments: JSON.parse(call.arguments) },
              answer: answer.output[0].type, previous: answer.previous_response_id === first.id };

const floats = await client.embeddings.create({ model, input: ["The cat sat.", "A dog ran."],
                                                encoding_format: "float" });
const packed = await client.embeddings.create({ model, input: "The cat sat." });  // base64, decoded by the SDK
out.embeddings = {
  count: floats.data.length, length: floats.data[0].embedding.length,
  sameAsBase64: floats.data[0].embedding.every((v, i) => Math.abs(v - packed.data[0].embedding[i]) < 1e-6),
  promptTokens: floats.usage.prompt_tokens,
};

const chat = await client.chat.completions.create({
  model, messages: [{ role: "user", content: "Say hello" }], max_tokens: 4,
});
out.chat = { object: chat.object, role: chat.choices[0].message.role };

let notFound = null;
try {
  await client.responses.retrieve("resp_does_not_exist");
} catch (error) {
  notFound = { status: error.status, code: error.code, isNotFound: error instanceof OpenAI.NotFoundError };
}
out.notFound = notFound;

console.log(JSON.stringify(out));
