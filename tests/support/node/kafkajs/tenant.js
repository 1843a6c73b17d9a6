// KafkaJS (its own codec, in JavaScript) through the proxy, for the integration tests:
//
//     node tenant.js <bootstrap> <client id> <topic> <group> <records>
//
// Creates <topic> (2 partitions), produces <records> records (acks=all, idempotent),
// reads them back in consumer group <group> and commits, then lists and describes what
// it sees, deletes the group and the topic. One line per step ("<step> <what it got>");
// exits 1 on the first failure ("failed <step>: ...").  With SASL_MECHANISM (PLAIN,
// SCRAM-SHA-256 or SCRAM-SHA-512), SASL_USER and SASL_PASSWORD in the environment, every
// connection logs in with them.
const { Kafka, logLevel } = require("kafkajs");

const [bootstrap, clientId, topic, group, records] = process.argv.slice(2);
const n = Number(records);
const say = (step, ...what) => console.log([step, ...what].join(" "));

async function main() {
  const mechanism = process.env.SASL_MECHANISM;
  const sasl = mechanism
    ? { mechanism: mechanism.toLowerCase(), username: process.env.SASL_USER, password: process.env.SASL_PASSWORD }
    : undefined;
  const kafka = new Kafka({ clientId, brokers: [bootstrap], sasl, logLevel: logLevel.NOTHING });
  const admin = kafka.admin();
  await admin.connect();
  await admin.createTopics({ topics: [{ topic, numPartitions: 2, replicationFactor: 1 }], waitForLeaders: true });
  say("create", topic);

  const producer = kafka.producer({ idempotent: true, maxInFlightRequests: 1 });
  await producer.connect();
  for (let i = 0; i < n; i++) {
    await producer.send({ topic, acks: -1, messages: [{ value: `kafkajs-${i}` }] });
  }
  await producer.disconnect();
  say("produced", n);

  const consumer = kafka.consumer({ groupId: group });
  await consumer.connect();
  await consumer.subscribe({ topics: [topic], fromBeginning: true });
  let got = 0;
  let assigned = null;
  await new Promise((resolve, reject) => {
    consumer.on(consumer.events.GROUP_JOIN, (e) => {
      assigned = Object.keys(e.payload.memberAssignment).sort().join(",");
    });
    consumer.run({
      autoCommit: false,
      eachMessage: async ({ topic: from, partition, message }) => {
        say("record", from, message.value.toString());
        await consumer.commitOffsets([{ topic: from, partition, offset: (BigInt(message.offset) + 1n).toString() }]);
        got++;
        if (got >= n) resolve();
      },
    }).catch(reject);
  });
  say("assigned", assigned);
  const described = await admin.describeGroups([group]);
  for (const g of described.groups) {
    say("describe-group", g.groupId, g.protocolType, g.members.length);
  }
  await consumer.disconnect();

  const offsets = await admin.fetchOffsets({ groupId: group, topics: [topic] });
  for (const t of offsets) {
    for (const p of t.partitions) say("offset", t.topic, p.partition, p.offset);
  }
  const groups = (await admin.listGroups()).groups.map((g) => g.groupId).sort();
  say("groups", groups.join(","));
  const topics = (await admin.listTopics()).sort();
  say("topics", topics.join(","));
  const metadata = await admin.fetchTopicMetadata({ topics: [topic] });
  say("metadata", metadata.topics.map((t) => `${t.name}:${t.partitions.length}`).join(","));
  await admin.deleteGroups([group]);
  say("delete-group", group);
  await admin.deleteTopics({ topics: [topic] });
  say("delete", topic);
  await admin.disconnect();
}

main().catch((err) => {
  console.log(`failed: ${err && err.stack ? err.stack.split("\n")[0] : err}`);
  process.exit(1);
});
