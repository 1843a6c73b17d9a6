// Two Go Kafka clients, franz-go (the newest protocol versions, its own codec) and Sarama
// (held to Kafka 2.1's versions: none flexible), for the integration tests:
//
//	gokafka franz|sarama <bootstrap> <client id> <topic> <group> <records>
//
// Each one, with its own admin API: creates <topic> (2 partitions), produces <records>
// records (acks=all; franz-go in a transaction, <group>-tx), reads them back in consumer
// group <group> (franz-go: KIP-848's protocol, read_committed) and commits, then lists
// and describes what it sees, deletes the group and the topic. It prints one line per
// step ("<step> <what it got>") and exits 1 on the first failure ("failed <step>: ...").
//
// With SASL_MECHANISM (franz-go: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; Sarama: PLAIN),
// SASL_USER and SASL_PASSWORD in the environment, every connection logs in with them.
package main

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/IBM/sarama"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
)

func say(step string, what ...any) {
	fmt.Println(strings.TrimSpace(step + " " + fmt.Sprintln(what...)))
}

func check(step string, err error) {
	if err != nil {
		fmt.Printf("failed %s: %v\n", step, err)
		os.Exit(1)
	}
}

func sorted(names []string) string {
	sort.Strings(names)
	return strings.Join(names, ",")
}

func franz(ctx context.Context, bootstrap, clientID, topic, group string, n int) {
	base := []kgo.Opt{kgo.SeedBrokers(bootstrap), kgo.ClientID(clientID)}
	user, password := os.Getenv("SASL_USER"), os.Getenv("SASL_PASSWORD")
	switch mechanism := os.Getenv("SASL_MECHANISM"); mechanism {
	case "":
	case "PLAIN":
		base = append(base, kgo.SASL(plain.Auth{User: user, Pass: password}.AsMechanism()))
	case "SCRAM-SHA-256":
		base = append(base, kgo.SASL(scram.Auth{User: user, Pass: password}.AsSha256Mechanism()))
	case "SCRAM-SHA-512":
		base = append(base, kgo.SASL(scram.Auth{User: user, Pass: password}.AsSha512Mechanism()))
	default:
		check("sasl", fmt.Errorf("unknown mechanism %q", mechanism))
	}
	cl, err := kgo.NewClient(base...)
	check("client", err)
	defer cl.Close()
	adm := kadm.NewClient(cl)

	created, err := adm.CreateTopic(ctx, 2, 1, nil, topic)
	check("create", err)
	check("create", created.Err)
	say("create", created.Topic)

	// In a transaction (transactional id <group>-tx), committed.
	producer, err := kgo.NewClient(append(base, kgo.DefaultProduceTopic(topic),
		kgo.TransactionalID(group+"-tx"))...)
	check("producer", err)
	check("begin", producer.BeginTransaction())
	for i := 0; i < n; i++ {
		check("produce", producer.ProduceSync(ctx, kgo.StringRecord(fmt.Sprintf("franz-%d", i))).FirstErr())
	}
	check("commit-transaction", producer.EndTransaction(ctx, kgo.TryCommit))
	producer.Close()
	say("produced", n)

	// A KIP-848 consumer (the broker assigns), reading committed records only.
	consumer, err := kgo.NewClient(append(base, kgo.ConsumerGroup(group), kgo.ConsumeTopics(topic),
		kgo.Balancers(kgo.RangeBalancer()), kgo.ServerSideBalancer(),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.DisableAutoCommit())...)
	check("consumer", err)
	got := 0
	for got < n {
		fetches := consumer.PollFetches(ctx)
		for _, e := range fetches.Errors() {
			check("consume", e.Err)
		}
		fetches.EachRecord(func(r *kgo.Record) {
			say("record", r.Topic, string(r.Value))
			got++
		})
	}
	check("commit", consumer.CommitUncommittedOffsets(ctx))
	described, err := adm.DescribeConsumerGroups(ctx, group)
	check("describe-group", err)
	mine := described[group]
	check("describe-group", mine.Err)
	say("assigned", sorted(mine.AssignedPartitions().Topics()))
	consumer.Close()

	offsets, err := adm.FetchOffsets(ctx, group)
	check("offsets", err)
	offsets.Each(func(o kadm.OffsetResponse) {
		say("offset", o.Topic, o.Partition, o.At)
	})
	groups, err := adm.ListGroups(ctx)
	check("groups", err)
	say("groups", sorted(groups.Groups()))
	topics, err := adm.ListTopics(ctx)
	check("topics", err)
	say("topics", sorted(topics.Names()))
	ends, err := adm.ListEndOffsets(ctx, topic)
	check("end-offsets", err)
	total := int64(0)
	ends.Each(func(o kadm.ListedOffset) { total += o.Offset })
	say("end-offsets", total)
	configs, err := adm.DescribeTopicConfigs(ctx, topic)
	check("configs", err)
	for _, resource := range configs {
		check("configs", resource.Err)
		say("configs", resource.Name)
	}
	producers, err := adm.DescribeProducers(ctx, kadm.TopicsSet{topic: {0: {}, 1: {}}})
	check("producers", err)
	producers.Each(func(t kadm.DescribedProducersTopic) { say("producers", t.Topic) })
	dirs, err := adm.DescribeAllLogDirs(ctx, nil)
	check("log-dirs", err)
	inDirs := map[string]bool{}
	dirs.Each(func(d kadm.DescribedLogDir) {
		for t := range d.Topics {
			inDirs[t] = true
		}
	})
	var dirTopics []string
	for t := range inDirs {
		dirTopics = append(dirTopics, t)
	}
	say("log-dirs", sorted(dirTopics))
	txn, err := adm.DescribeTransactions(ctx, group+"-tx")
	check("transaction", err)
	for _, t := range txn {
		say("transaction", t.TxnID, t.State)
	}
	transactions, err := adm.ListTransactions(ctx, nil, nil)
	check("transactions", err)
	var txnIDs []string
	for id := range transactions {
		txnIDs = append(txnIDs, id)
	}
	say("transactions", sorted(txnIDs))

	deletedGroups, err := adm.DeleteGroups(ctx, group)
	check("delete-group", err)
	check("delete-group", deletedGroups.Error())
	say("delete-group", group)
	deleted, err := adm.DeleteTopics(ctx, topic)
	check("delete", err)
	check("delete", deleted.Error())
	say("delete", topic)
}

type reader struct {
	want   int
	got    int
	cancel context.CancelFunc
}

func (r *reader) Setup(sarama.ConsumerGroupSession) error   { return nil }
func (r *reader) Cleanup(sarama.ConsumerGroupSession) error { return nil }
func (r *reader) ConsumeClaim(sess sarama.ConsumerGroupSession, claim sarama.ConsumerGroupClaim) error {
	for msg := range claim.Messages() {
		say("record", msg.Topic, string(msg.Value))
		sess.MarkMessage(msg, "")
		r.got++
		if r.got >= r.want {
			sess.Commit()
			r.cancel()
		}
	}
	return nil
}

func saramaClient(ctx context.Context, bootstrap, clientID, topic, group string, n int) {
	cfg := sarama.NewConfig()
	cfg.ClientID = clientID
	cfg.Producer.Return.Successes = true
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Consumer.Offsets.Initial = sarama.OffsetOldest
	// Kafka 2.1's versions: none flexible (KIP-482), the oldest Kafka 4 still takes.
	cfg.Version = sarama.V2_1_0_0
	if mechanism := os.Getenv("SASL_MECHANISM"); mechanism != "" {
		if mechanism != "PLAIN" {
			check("sasl", fmt.Errorf("sarama here logs in with PLAIN only, not %q", mechanism))
		}
		cfg.Net.SASL.Enable = true
		cfg.Net.SASL.Mechanism = sarama.SASLTypePlaintext
		cfg.Net.SASL.User = os.Getenv("SASL_USER")
		cfg.Net.SASL.Password = os.Getenv("SASL_PASSWORD")
	}
	brokers := []string{bootstrap}
	say("version", cfg.Version.String())

	admin, err := sarama.NewClusterAdmin(brokers, cfg)
	check("admin", err)
	defer admin.Close()
	check("create", admin.CreateTopic(topic, &sarama.TopicDetail{NumPartitions: 2, ReplicationFactor: 1}, false))
	say("create", topic)

	producer, err := sarama.NewSyncProducer(brokers, cfg)
	check("producer", err)
	for i := 0; i < n; i++ {
		_, _, err := producer.SendMessage(&sarama.ProducerMessage{
			Topic: topic, Value: sarama.StringEncoder(fmt.Sprintf("sarama-%d", i))})
		check("produce", err)
	}
	check("producer-close", producer.Close())
	say("produced", n)

	consumerGroup, err := sarama.NewConsumerGroup(brokers, group, cfg)
	check("consumer", err)
	reading, cancel := context.WithCancel(ctx)
	handler := &reader{want: n, cancel: cancel}
	for reading.Err() == nil {
		check("consume", consumerGroup.Consume(reading, []string{topic}, handler))
	}
	check("consume", ctx.Err())
	check("consumer-close", consumerGroup.Close())

	offsets, err := admin.ListConsumerGroupOffsets(group, nil)
	check("offsets", err)
	for name, partitions := range offsets.Blocks {
		for p, block := range partitions {
			say("offset", name, p, block.Offset)
		}
	}
	listed, err := admin.ListConsumerGroups()
	check("groups", err)
	var groupNames []string
	for name := range listed {
		groupNames = append(groupNames, name)
	}
	say("groups", sorted(groupNames))
	described, err := admin.DescribeConsumerGroups([]string{group})
	check("describe-group", err)
	say("describe-group", described[0].GroupId, described[0].State)
	topics, err := admin.ListTopics()
	check("topics", err)
	var topicNames []string
	for name := range topics {
		topicNames = append(topicNames, name)
	}
	say("topics", sorted(topicNames))
	check("delete-group", admin.DeleteConsumerGroup(group))
	say("delete-group", group)
	check("delete", admin.DeleteTopic(topic))
	say("delete", topic)
}

func main() {
	if len(os.Args) != 7 {
		fmt.Fprintln(os.Stderr, "usage: gokafka franz|sarama <bootstrap> <client id> <topic> <group> <records>")
		os.Exit(2)
	}
	n, err := strconv.Atoi(os.Args[6])
	check("args", err)
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	switch os.Args[1] {
	case "franz":
		franz(ctx, os.Args[2], os.Args[3], os.Args[4], os.Args[5], n)
	case "sarama":
		saramaClient(ctx, os.Args[2], os.Args[3], os.Args[4], os.Args[5], n)
	default:
		check("args", fmt.Errorf("unknown client %q", os.Args[1]))
	}
}
