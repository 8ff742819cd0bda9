// Streams one generation from an esurge-serve with @grpc/grpc-js, loading the
// .proto files at run time with @grpc/proto-loader, and prints one JSON line:
// {"tokens": [...], "finish": "...", "requestId": "...", "messages": N}.
//
//   node generate.js HOST:PORT PROTO_ROOT REQUEST_ID MAX_TOKENS TOKEN_ID...
'use strict';
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const [target, protoRoot, requestId, maxTokens, ...prompt] = process.argv.slice(2);
const definition = protoLoader.loadSync('esurge/v1/service.proto', {
  includeDirs: [protoRoot], keepCase: true, longs: String, enums: String, defaults: false,
});
const esurge = grpc.loadPackageDefinition(definition).esurge.v1;
const client = new esurge.EngineService(target, grpc.credentials.createInsecure());

const call = client.Generate({
  request: {
    request_id: requestId,
    prompt_token_ids: { token_ids: prompt.map(Number) },
    sampling_params: { temperature: 0, max_tokens: Number(maxTokens), ignore_eos: true },
  },
}, { deadline: Date.now() + 120000 });

const tokens = [];
let finish = null;
let echoed = null;
let messages = 0;
call.on('metadata', (metadata) => { echoed = metadata.get('x-request-id')[0] || null; });
call.on('data', (message) => {
  messages += 1;
  tokens.push(...message.token_ids);
  if (message.finish_reason && message.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
    finish = message.finish_reason;
  }
});
call.on('error', (error) => {
  console.error(`grpc error ${error.code}: ${error.details}`);
  process.exit(1);
});
call.on('end', () => {
  console.log(JSON.stringify({ tokens, finish, requestId: echoed, messages }));
  client.close();
});
