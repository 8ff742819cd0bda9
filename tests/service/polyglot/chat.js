// One chat turn from an esurge-serve with @grpc/grpc-js (the server renders the
// messages with the model's chat template) and prints one JSON line:
// {"tokens": [...], "finish": "...", "promptTokens": N}.
//
//   node chat.js HOST:PORT PROTO_ROOT MAX_TOKENS ROLE CONTENT [ROLE CONTENT ...]
'use strict';
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [target, protoRoot, maxTokens, ...turns] = process.argv.slice(2);
const messages = [];
for (let i = 0; i + 1 < turns.length; i += 2) messages.push({ role: turns[i], content: turns[i + 1] });
const definition = protoLoader.loadSync('esurge/v1/service.proto', {
  includeDirs: [protoRoot], keepCase: true, longs: String, enums: String, defaults: false,
});
const esurge = grpc.loadPackageDefinition(definition).esurge.v1;
const client = new esurge.EngineService(target, grpc.credentials.createInsecure());

const call = client.Generate({
  request: { chat: { messages }, sampling_params: { temperature: 0, max_tokens: Number(maxTokens) } },
}, { deadline: Date.now() + 120000 });

const tokens = [];
let finish = null;
let promptTokens = null;
call.on('data', (message) => {
  tokens.push(...message.token_ids);
  if (message.prompt_info) promptTokens = message.prompt_info.num_prompt_tokens;
  if (message.finish_reason && message.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
    finish = message.finish_reason;
  }
});
call.on('error', (error) => {
  console.error(`grpc error ${error.code}: ${error.details}`);
  process.exit(1);
});
call.on('end', () => {
  console.log(JSON.stringify({ tokens, finish, promptTokens }));
  client.close();
});
